"""One pipeline's layer split and per-stage options (split.py), the surrogate they are scored by, the CP-SAT
stage models that refine them (one pipeline class, and every class with the batch shares), and selective
recompute."""
