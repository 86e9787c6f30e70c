"""numpy reference of one-bit compression with error feedback (zk.h,
"One-bit compression"): what the daemon's kernel must produce, bit for bit,
for the same inputs."""

import numpy as np


def nbytes(block, numel):
    blocks = -(-numel // block)
    return blocks * 4 + (numel + 7) // 8


def encode(block, x, error):
    """Returns (bytes, new error) for x + error, without changing either."""
    x = np.asarray(x, dtype=np.float32)
    y = x + np.asarray(error, dtype=np.float32)  # fp32, one rounding
    new_error = np.array(error, dtype=np.float32, copy=True)
    blocks = -(-x.size // block)
    scales = np.empty(blocks, dtype=np.float32)
    negative = y < np.float32(0)
    for b in range(blocks):
        part = y[b * block:(b + 1) * block]
        if not np.all(np.isfinite(part)):
            scales[b] = np.float32("nan")
            continue
        # Summed in double in element order (cumsum is sequential), the
        # mean rounded to fp32 once.
        total = np.cumsum(np.abs(part.astype(np.float64)))[-1]
        scales[b] = np.float32(total / part.size)
        signs = np.where(negative[b * block:(b + 1) * block], -scales[b], scales[b])
        new_error[b * block:(b + 1) * block] = part - signs.astype(np.float32)
    bits = np.packbits(negative.astype(np.uint8), bitorder="little")
    return np.concatenate([scales.view(np.uint8), bits]), new_error


def decode(block, data, numel):
    blocks = -(-numel // block)
    scales = data[:blocks * 4].view(np.float32)
    negative = np.unpackbits(data[blocks * 4:], bitorder="little")[:numel].astype(bool)
    per_element = np.repeat(scales, block)[:numel]
    return np.where(negative, -per_element, per_element).astype(np.float32)
