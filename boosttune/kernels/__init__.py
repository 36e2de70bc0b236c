"""Tree-attention kernels: Triton on GPU, a PyTorch path on CPU (one file per kernel).
``tree_attention`` (the dispatcher and the PyTorch reference), ``tree_attention_triton`` (the Triton
kernel), ``tree_attention_inputs`` (the input checks both share: the dispatcher imports the kernel,
never the reverse).
"""
