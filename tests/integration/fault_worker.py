"""A worker for the fault tests, speaking the raw protocol (zdraw).

    fault_worker.py SOCKET JOB RANK STEPS [DIE_AT DIE_STEP]

Registers one unit, then runs STEPS steps of gather, release, gradient
buffer (filled with ones), reduce and step. With DIE_AT (gather, reduce or
step) it sends that request at step DIE_STEP and kills itself with SIGKILL
before the reply, so the daemon loses it in the middle of the operation.
Prints "OK <version>" at the end, or "ERROR <status> <message>" and exits 3
when the daemon answers with an error.
"""

import mmap
import os
import signal
import struct
import sys

import zdraw as z

NUMEL = 4096


def main():
    path, job, rank, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    die_at = sys.argv[5] if len(sys.argv) > 5 else None
    die_step = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    c = z.Conn(path, timeout=120)
    maps = {}

    def call(msg_type, payload=b""):
        t, fields, fds = c.call(msg_type, payload)
        if t == z.ERROR:
            print("ERROR %s %s" % (z.status_of(fields), z.message_of(fields)), flush=True)
            sys.exit(3)
        if fds:
            buf_id, size = fields[2][0], fields[3][0]
            maps[buf_id] = mmap.mmap(fds[0], size)
            os.close(fds[0])
        return fields

    def die_now(msg_type, payload=b""):
        c.send(msg_type, payload)
        os.kill(os.getpid(), signal.SIGKILL)

    call(z.ATTACH, z.attach_request(job, rank))
    fields = call(z.REGISTER_UNIT, z.register_request(
        "layer", (("w", (NUMEL,)),), init=z.INIT_SEEDED_NORMAL, seed=7, std=0.02))
    unit = z.unit_request(fields.get(1, [0])[0])
    print("READY", flush=True)
    ones = struct.pack("<f", 1.0) * NUMEL
    version = 0
    for step in range(steps):
        if die_at == "gather" and step == die_step:
            die_now(z.GATHER, unit)
        call(z.GATHER, unit)
        call(z.RELEASE, unit)
        fields = call(z.GRAD_BUFFER, unit)
        maps[fields[2][0]][0:len(ones)] = ones
        if die_at == "reduce" and step == die_step:
            die_now(z.REDUCE, unit)
        call(z.REDUCE, unit)
        if die_at == "step" and step == die_step:
            die_now(z.STEP)
        fields = call(z.STEP)
        version = fields.get(2, [0])[0]
    call(z.DETACH)
    print("OK %d" % version, flush=True)


if __name__ == "__main__":
    main()
