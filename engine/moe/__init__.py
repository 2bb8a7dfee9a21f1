"""One MoE layer: how its experts are laid out, dispatch and combine, the grouped static graph, the exact CPU
experts.
"""
