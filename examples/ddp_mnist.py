"""Listing 7.2 (two-process MNIST training with DDP), fixed; torch and torchvision only.

    python examples/ddp_mnist.py [--world-size 2]                     # starts its ranks itself (mp.spawn)
    torchrun --standalone --nproc-per-node 2 examples/ddp_mnist.py    # torchrun starts them

Offline: python -m ddp_helpers.data write-mnist ~/.pytorch/MNIST_5k/, then add --data-root ~/.pytorch/MNIST_5k/
"""
import argparse
import contextlib
import io
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

OFFLINE = "python -m ddp_helpers.data write-mnist ~/.pytorch/MNIST_5k/"


def download(root):
    """Read MNIST at root, downloading it if missing; False if it is neither there nor downloadable."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # torchvision prints every failed mirror
            for train in (True, False):
                datasets.MNIST(root, train=train, download=True)
    except (OSError, RuntimeError):
        print(f"MNIST is not in {root} and can't be downloaded: run `{OFFLINE}` and add --data-root "
              "~/.pytorch/MNIST_5k/", file=sys.stderr)
        return False
    return True


def load_mnist(root, local_rank, device):
    """Train and test sets; one process per node reads or downloads them while the others wait."""
    # Not every rank at once, as in the listing: ranks writing the same files at the same time corrupt them.
    ok = torch.tensor([int(download(root)) if local_rank == 0 else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # the barrier, which also tells every rank whether it worked
    if not ok.item():
        return None
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    return [datasets.MNIST(root, train=train, transform=transform) for train in (True, False)]


def main(args):
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= gpus_per_node  # nccl: a GPU per rank
    if use_gpu:
        torch.cuda.set_device(local_rank)  # else every rank would allocate on cuda:0
    device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
    dist.init_process_group("nccl" if use_gpu else "gloo")  # address, port, rank and size from the environment
    torch.set_num_threads(1)  # ranks share the cores (torchrun's default); results don't depend on the machine
    data = load_mnist(os.path.expanduser(args.data_root), local_rank, device)
    if data is None:  # local rank 0 has said why
        dist.destroy_process_group()
        return 1
    trainset, testset = data
    sampler = DistributedSampler(trainset)  # each rank its own shuffled 1/world_size of the data, not all of it
    train_loader = DataLoader(trainset, batch_size=64, sampler=sampler)  # sampler, not shuffle=True;
    # no num_workers=2: the images are in memory already, and worker processes cost more to start than they save
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10)).to(device)  # torch's Flatten = the listing's class
    model = DistributedDataParallel(model, device_ids=[local_rank] if use_gpu else None)  # no device_ids on CPU
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch (the same on all ranks, so shards stay disjoint)
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            if rank == 0 and (step % 100 == 0 or step == len(train_loader) - 1):  # now and then, not every batch
                print(f"epoch {epoch} step {step + 1}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
    model.eval()  # the test set was never used: score it, each rank a disjoint slice
    counts = torch.zeros(2, dtype=torch.long, device=device)  # correct, seen
    with torch.no_grad():
        for x, y in DataLoader(Subset(testset, range(rank, len(testset), world_size)), batch_size=1000):
            counts += torch.stack([(model(x.to(device)).argmax(1) == y.to(device)).sum(), torch.tensor(len(y))
                                   .to(device)])
    dist.all_reduce(counts)  # one sum over the ranks
    if rank == 0:
        print(f"test accuracy: {counts[0].item() / counts[1].item():.4f}")
        if args.save:  # for checking this run against another (the replicas are identical: rank 0's will do)
            torch.save(model.module.state_dict(), args.save)
    dist.destroy_process_group()  # leave the group cleanly: no hangs or warnings at exit
    return 0


def spawned(rank, world_size, args):
    """mp.spawn's entry point: set what torchrun would have set, then run main."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    sys.exit(main(args))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks to start (ignored under torchrun)")
    p.add_argument("--data-root", default="~/.pytorch/MNIST_data/", help="torchvision's MNIST folder")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save", metavar="PATH", help="write the final state_dict here (to compare runs)")
    args = p.parse_args()
    if "RANK" in os.environ:  # started by torchrun, which has set the address, port, rank and size
        sys.exit(main(args))
    if not download(os.path.expanduser(args.data_root)):  # here, before any rank starts: one clear line
        sys.exit(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # a port the OS says is free, not a fixed 23456 that may be taken
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # loopback: the ranks are all here
    try:
        mp.spawn(spawned, args=(args.world_size, args), nprocs=args.world_size)
    except mp.ProcessExitedException as e:  # a rank exited with an error code and has said why
        sys.exit(e.exit_code)
