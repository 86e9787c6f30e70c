"""numpy reference of low-rank (PowerSGD) compression (zk.h, "Low-rank
compression"): what the daemon's kernels must produce, bit for bit, for the
same inputs; and round(), the whole cross-node operator the daemon runs.

Every sum is accumulated in float64 in the order zk.h states, one term at a
time (float64 elementwise ops are IEEE and round as C's double ops do; the
product of two float32 values is exact in float64), and rounded to float32
once. np.dot, matmul and sum are avoided: their order of summation differs.
"""

import numpy as np

f32, f64 = np.float32, np.float64


def project(M, Q):
    """P = M Q: P[i][j] = sum over k ascending of M[i][k] * Q[k][j]."""
    M = np.asarray(M, dtype=f32)
    Q = np.asarray(Q, dtype=f32)
    rows, cols = M.shape
    acc = np.zeros((rows, Q.shape[1]), dtype=f64)
    for k in range(cols):
        acc += M[:, k:k + 1].astype(f64) * Q[k].astype(f64)
    return acc.astype(f32)


def back(M, P):
    """Q = M^T P: Q[k][j] = sum over i ascending of M[i][k] * P[i][j]."""
    M = np.asarray(M, dtype=f32)
    P = np.asarray(P, dtype=f32)
    rows, cols = M.shape
    acc = np.zeros((cols, P.shape[1]), dtype=f64)
    for i in range(rows):
        acc += M[i][:, None].astype(f64) * P[i].astype(f64)
    return acc.astype(f32)


def _column_dot(a, b):
    """sum over i ascending of a[i] * b[i], float64 (cumsum is sequential)."""
    if a.size == 0:
        return f64(0.0)
    return np.cumsum(a.astype(f64) * b.astype(f64))[-1]


def orthonormalize(P):
    """Gram-Schmidt on the columns of P (rows x rank), returned as a copy:
    for column j in order, subtract d * column k for each earlier k (d its
    float64 dot with column j; d * P[i][k] rounded to float64, then the
    difference, then to float32), then divide by the float64 norm (a zero
    column stays zero)."""
    P = np.array(P, dtype=f32, copy=True)
    rows, rank = P.shape
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for j in range(rank):
            for k in range(j):
                d = _column_dot(P[:, k], P[:, j])
                P[:, j] = (P[:, j].astype(f64) - d * P[:, k].astype(f64)).astype(f32)
            n = np.sqrt(_column_dot(P[:, j], P[:, j]))
            if n == 0:
                P[:, j] = f32(0.0)
            else:
                P[:, j] = (P[:, j].astype(f64) / n).astype(f32)
    return P


def expand(P, Q, numel, out=None, mode="set"):
    """The first numel elements (row-major) of P Q^T, each
    a[i][k] = sum over j ascending of P[i][j] * Q[k][j] rounded to float32,
    put into the first numel elements of a flat copy of out (numel zeros
    when None; past numel it is left as it was) and returned: "set"
    out = a, "add" out + a, "subtract" out - a, in float32."""
    P = np.asarray(P, dtype=f32)
    Q = np.asarray(Q, dtype=f32)
    rows, rank = P.shape
    cols = Q.shape[0]
    assert numel <= rows * cols
    acc = np.zeros((rows, cols), dtype=f64)
    for j in range(rank):
        acc += P[:, j:j + 1].astype(f64) * Q[:, j].astype(f64)
    a = acc.astype(f32).reshape(-1)[:numel]
    res = np.zeros(numel, dtype=f32) if out is None else np.array(out, dtype=f32).reshape(-1)
    assert res.size >= numel
    with np.errstate(invalid="ignore", over="ignore"):
        if mode == "set":
            res[:numel] = a
        elif mode == "add":
            res[:numel] = res[:numel] + a
        elif mode == "subtract":
            res[:numel] = res[:numel] - a
        else:
            raise ValueError(mode)
    return res


def pad(x, rows, cols):
    """x (fp32, length s <= rows * cols) as a rows x cols matrix, padded with zeros."""
    M = np.zeros(rows * cols, dtype=f32)
    M[:np.asarray(x).size] = x
    return M.reshape(rows, cols)


def round(partials, errors, qs, rows, cols, rank):
    """One cross-node low-rank reduce-scatter with error feedback, as the
    daemon runs it (daemon/backend/comm_hier.c, COMM_WIRE_LOWRANK).

    N nodes. partials[m][n] is node m's partial sum (fp32, length s) for the
    slice owned by node n; errors[m][n] node m's error feedback for slice n
    (length s; errors[m][m] unused, stays zero); qs[m][n] node m's warm-start
    Q for slice n (cols x rank fp32; qs[m][m] unused). rows * cols >= s;
    each slice is padded with zeros to rows x cols. For every node m and
    slice n != m, on node m alone:
      1. M = pad(partials[m][n] + errors[m][n]) (fp32 add);
      2. P = orthonormalize(project(M, qs[m][n]));
      3. Q = back(M, P), which becomes qs[m][n] (the next warm start);
      4. errors[m][n] = the first s elements of expand(P, Q, s, out=M
         flattened, mode="subtract"): M less what is sent;
      5. P and Q go to node n.
    Node n receives recv[n] = partials[n][n], then for each m != n in
    ascending order recv[n] = expand(P from m, Q from m, s, out=recv[n],
    mode="add"): its own partial exactly, the others' through their factors.

    Returns (recv, errors, qs) as new lists of lists; the inputs are not
    changed."""
    N = len(partials)
    s = np.asarray(partials[0][0]).size
    assert rows * cols >= s
    new_qs = [[np.asarray(q, dtype=f32).copy() for q in row] for row in qs]
    new_errors = [[np.zeros(s, dtype=f32) for _ in range(N)] for _ in range(N)]
    sent = [[None] * N for _ in range(N)]
    for m in range(N):
        for n in range(N):
            if n == m:
                continue
            x = np.asarray(partials[m][n], dtype=f32) + np.asarray(errors[m][n], dtype=f32)
            M = pad(x, rows, cols)
            P = orthonormalize(project(M, qs[m][n]))
            Q = back(M, P)
            new_qs[m][n] = Q
            new_errors[m][n] = expand(P, Q, s, out=M, mode="subtract")[:s]
            sent[m][n] = (P, Q)
    recv = []
    for n in range(N):
        out = np.asarray(partials[n][n], dtype=f32).copy()
        for m in range(N):
            if m != n:
                out = expand(sent[m][n][0], sent[m][n][1], s, out=out, mode="add")
        recv.append(out)
    return recv, new_errors, new_qs


def initial_q(node, cols, rank):
    """The warm start a rank's unit begins with for node `node`'s slice
    (daemon/rank/lowrank.c, warm_start_init): cols x rank values in [-1, 1)
    from a counter hash of (node, element), the same on every rank."""
    mask = (1 << 64) - 1
    out = np.empty(cols * rank, dtype=np.float32)
    for i in range(cols * rank):
        z = ((node << 40) + i + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out[i] = np.float32(float(z >> 40) / float(1 << 23) - 1.0)
    return out.reshape(cols, rank)
