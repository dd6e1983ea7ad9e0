"""The CUDA path: tests that skip without a CUDA device (marker ``gpu``) and `check`, the measurements and
short real run of `scripts/gpu_check.sh` (docs/gpu.md)."""
