"""Graph passes: capture, block detection, annotation. Each takes a graph and returns a new one."""
