"""Developer tools for cosmos3_core (tiny checkpoint generation, etc.)."""
