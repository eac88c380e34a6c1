"""A worker process of a group: `python -m cosmos3_core.parallel.worker RANK STORE_PORT SPEC_JSON` (started by
`group.Group`, never by hand).

It joins the process group through rank 0's TCPStore, makes the same subgroups, loads its parts (the GEN tower
and a K/V pool shard for "denoise"; the VAE decoder for "decode"), then loops: receive a command, do it, until
"stop" or an error (rank 0 gone, a peer gone) ends the process. A rank outside a command's role (the CLI's group
can have more decode than denoise ranks, or the reverse) only receives it. It also ends when its parent does.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..caches import precompiled_dir
from ..model.checkpoint import Checkpoint
from ..model.layers import GEN
from ..model.towers import EAGER, GenKernels
from .comm import Comm, recv_command
from .denoise import DenoiseWorker
from .group import WorkerSpec
from .vae import DecodeWorker


def _orphan_watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(3)  # rank 0 is gone (NCCL would wait in a collective for it forever)


def main(argv: list[str]) -> int:
    rank, port, spec = int(argv[0]), int(argv[1]), WorkerSpec.from_json(argv[2])
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    device = f"cuda:{rank}" if spec.device.startswith("cuda") else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    ranks = spec.parallel.ranks
    timeout = datetime.timedelta(seconds=1800)
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=False, timeout=timeout)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=ranks, timeout=timeout)
    comm = Comm(rank, spec.parallel)
    comm.build()
    ckpt, dtype = Checkpoint.open(spec.checkpoint, spec.precision, spec.fp8_policy), getattr(torch, spec.dtype)
    denoise = decode = None
    if "denoise" in spec.roles and comm.denoises:
        model = ckpt.load_transformer({GEN}, device, dtype)
        kernels = GenKernels.compiled(model, precompiled_dir()) if spec.compile else EAGER  # as rank 0's
        denoise = DenoiseWorker(model, comm, spec.pool_pages, spec.page_size, kernels, spec.attention,
                                spec.cuda_graphs, device, spec.max_captures)  # fmt: skip
    if "decode" in spec.roles and comm.decodes:
        decode = DecodeWorker(ckpt.load_vae_decoder(device, dtype), comm, spec.compile and device.startswith("cuda"))
    dist.barrier()  # loaded: rank 0 starts sending
    with torch.inference_mode():
        while True:
            header, tensors = recv_command(device)
            op = header["op"]
            if op == "stop":
                break
            if op == "write" and denoise is not None:
                denoise.write(header, tensors)
            elif op == "step" and denoise is not None:
                denoise.run(header, tensors)
            elif op == "decode" and decode is not None:
                decode.run(header, tensors)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
