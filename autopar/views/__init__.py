"""Views: how plans are shown to people (`Plan.explain()`'s tables, `Plan.timeline()`'s trace, the graph
section of graph workloads). Above the plan and the planners whose data they read; nothing below imports
them except `Plan`'s two thin methods (named in tests/test_layers.py)."""
