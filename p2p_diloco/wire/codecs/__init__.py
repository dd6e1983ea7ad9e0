"""Tensors to bytes and back: the codec a manifest names (`codec`: fp32, fp16, bf16, int8 blockwise, sparse
top-k with int8 or int4 values), its parts (`blockwise` quantization, `bitpack`, `levels`, `sparse`
indices, `chunked` large payloads) and a learner's error feedback (`feedback`), which compresses a delta
and keeps what the codec dropped for the next one."""
