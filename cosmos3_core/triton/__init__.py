"""The Triton side: glue for the three models (glue.py), cancel and drain marks (cancel.py), the tritonserver
launcher (launcher.py) and the supervisor that renders the model repository and runs it (serve.py,
`python -m cosmos3_core.triton.serve`). Nothing below this package imports it."""
