"Run a test body on N local gloo ranks (torch.multiprocessing.spawn) with a teardown that cannot abort the rank."
import os, sys, traceback
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_entry(rank, body, world, args):
    "Join the group, run `body(rank, world, *args)`, meet at a barrier, leave without interpreter teardown."
    torch.set_num_threads(1)  # N ranks on a few cores: no oversubscription
    dist.init_process_group("gloo", init_method=f"file://{args[0]}", rank=rank, world_size=world)
    code = 0
    try:
        body(rank, world, *args[1:])
        dist.barrier()  # no rank tears down the store while another still uses it
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc(); code = 1
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code)  # results are on disk; gloo's threads can abort a normal interpreter exit


def run_ranks(body, world, init_file, *args):
    "Run module-level `body(rank, world, *args)` on `world` gloo ranks rendezvousing through `init_file`."
    mp.spawn(_rank_entry, args=(body, world, (str(init_file), *args)), nprocs=world, join=True)
