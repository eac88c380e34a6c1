"""Weights and maths: the checkpoint reader and its config, the transformer's layers and towers, rotary
positions, prompts, the VAE (our Wan2.2 decoder, diffusers' otherwise), v2v conditioning, sound and robot actions
(embodiments, action). Imports nothing of the runtime (rows, step, scheduler, engine, stages, Triton) but the
attention kernels' interface."""
