"""Weights and maths: the checkpoint reader and its config, the transformer's layers and towers, rotary
positions, prompts, the VAE (our Wan2.2 decoder, diffusers' otherwise), v2v conditioning, sound and robot actions
(embodiments, action); the generated checkpoints (the tiny default, `random:*` skeletons: provision, tiny,
random_checkpoint). Imports nothing of the runtime (rows, attention, step, scheduler, engine, stages, Triton) nor
tools/: the towers take the step's attention as an argument (`attend.Attend`); tests/test_imports.py checks it."""
