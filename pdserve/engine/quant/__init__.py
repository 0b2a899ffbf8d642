"""Weight-only quantization: int8/int4 on the fly and AWQ/GPTQ checkpoints.

`formats` is torch-free (the CLI and `pdserve plan` read it); `pack`, `linear` and
`checkpoint` hold the tensors: packing, the quantized linears the model calls through
`linear.linear`, and the reader of pre-quantized checkpoint tensors.
"""
