"""Lowerings only NVIDIA GPUs run: tensor-core products through mma.sync (`mma`, compute
capability 8.0+), Hopper's warpgroup products (`wgmma`) fed by tensor maps (`tma`), and
the K-major operand copies TF32 products need (`kcopy`)."""
