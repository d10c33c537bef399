"""Probe: host µs of the steady decode's native call (``begin_decode``) by how its host arguments arrive: as numpy
arrays (converted by tvm-ffi in the call), as the held batch's pre-converted rows and live mask (Upload._held, the
steady path now), and with every argument pre-converted; plus one conversion of each kind alone. The call declines the
batch (its rows' chains do not continue), so it checks and converts everything and changes nothing; the calls run
round-robin. Usage: python3 gpu/probe_ffi_args.py [iters] [batch size, default 1] [device, default cpu]."""

import statistics
import sys
from collections.abc import Callable

import torch
import tvm_ffi
from kvcanary.upload import _sources, host_array, host_i64

from bench.bench_runtime import make_config, warmed
from bench.call_times import round_robin


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    bs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    dev = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
    w, m = warmed(bs, 64, 8, dev, make_config("default", dev.type, bs, 64))
    b, up = w.batch(1), m.upload
    st, (h, n, seen, prefix) = up._stage, up._row_state
    src = _sources(b)
    host = tuple(host_i64(x) for x in (b.req_pool_indices_host, b.prefix_lens_host, b.extend_lens_host))
    new, live = host_array(b.true_new_tokens), host[0] != m.pool.padding_row
    ffi_src, ffi_host = tuple(tvm_ffi.from_dlpack(x) for x in src), tuple(tvm_ffi.from_dlpack(x) for x in host)
    ffi_new, ffi_live = tvm_ffi.from_dlpack(new), tvm_ffi.from_dlpack(live)

    def call(s: tuple[object, ...], hst: tuple[object, ...], nw: object, lv: object) -> Callable[[], object]:
        # a token offset the rows' chains do not have: no chain continues, so the call returns NOT_STEADY after every
        # check and conversion, and writes nothing
        return lambda: st._decode(*s, st._staging[0], *st._dst, bs, int(b.input_ids.shape[0]), st.padding_row, *hst,
                                  nw, lv, h, n, up.chains.offset + 1, seen, prefix, 1, st._no_reuse, 0)
    cases = {"begin_decode, numpy host facts (before)": call(src, host, new, live),
             "begin_decode, held rows and live pre-converted (now)": call(src, (ffi_host[0], *host[1:]), new, ffi_live),
             "begin_decode, every argument pre-converted": call(ffi_src, ffi_host, ffi_new, ffi_live),
             "tvm_ffi.from_dlpack of a numpy array": lambda: tvm_ffi.from_dlpack(host[1]),
             "tvm_ffi.from_dlpack of a torch tensor": lambda: tvm_ffi.from_dlpack(src[1])}
    if cases["begin_decode, numpy host facts (before)"]() != -1:
        raise SystemExit("probe: begin_decode did not decline the batch")
    for k, v in round_robin(cases, iters).items():
        print(f"bs {bs} {dev.type}: {k:55s} median {1e6 * statistics.median(v):6.2f} us")


if __name__ == "__main__":
    main()
