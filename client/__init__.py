"""Client for the `cosmos3` Triton ensemble: gRPC streaming, progress bar, TTFC / end-to-end timing."""
