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


class Flatten(nn.Module):
    def forward(self, input):
        return input.view(input.size(0), -1)


def train(model, trainloader, criterion, optimizer, device, log):
    model.train()
    for batch_idx, (data, target) in enumerate(trainloader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        if log and (batch_idx % 100 == 0 or batch_idx == len(trainloader) - 1):  # now and then, not every batch
            print(f"batch {batch_idx + 1}/{len(trainloader)}, loss {loss.item():.4f}", flush=True)


def evaluate(model, testset, rank, world_size, device):
    """Test accuracy: each rank scores a disjoint slice, one all_reduce sums the counts."""
    model.eval()
    correct = 0
    part = Subset(testset, range(rank, len(testset), world_size))  # no padding: every image counted once
    with torch.no_grad():
        for data, target in DataLoader(part, batch_size=1000):
            correct += int((model(data.to(device)).argmax(1) == target.to(device)).sum())
    counts = torch.tensor([correct, len(part)], device=device)
    dist.all_reduce(counts)  # sum over the ranks
    return counts[0].item() / counts[1].item()


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


def main(args):
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    filepath = args.data_root  # a flag, no longer fixed
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= gpus_per_node  # nccl: a GPU per rank
    if use_gpu:
        torch.cuda.set_device(local_rank)  # else NCCL, the CUDA context and tensors without a device go to cuda:0
    dist.init_process_group(backend="nccl" if use_gpu else "gloo")  # address, port, rank, size: environment
    torch.set_num_threads(1)  # ranks share the cores (torchrun's default); results don't depend on the machine
    torch.manual_seed(0)
    device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")  # local: counts from 0 per node
    # One process per node reads or downloads, not every rank at once (writing the same files corrupts them).
    ok = torch.tensor([int(download(filepath)) if local_rank == 0 else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # the barrier, which also tells every rank whether it worked
    if not ok.item():
        dist.destroy_process_group()
        return 1
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    trainset = datasets.MNIST(filepath, train=True, transform=transform)  # already there: no download
    testset = datasets.MNIST(filepath, train=False, transform=transform)  # to measure the result
    sampler = DistributedSampler(trainset)  # shuffles; each rank its own 1/world_size of the data, not all
    # Loader workers turn samples into tensors (PIL, ToTensor, Normalize) while the rank trains. On a GPU that is
    # what keeps it fed; on a CPU with no spare cores (ranks x (1 + workers) processes on a few cores) they only
    # compete with the ranks, and the rank does that work better itself.
    workers = 2 if use_gpu else 0
    train_loader = DataLoader(trainset, batch_size=64, sampler=sampler, num_workers=workers, pin_memory=use_gpu,
                              persistent_workers=workers > 0)
    model = nn.Sequential(Flatten(), nn.Linear(784, 10)).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if use_gpu else None)  # none on CPU
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(args.epochs):  # the listing trains one epoch
        sampler.set_epoch(epoch)  # a new shuffle every epoch (the same on all ranks, so shards stay disjoint)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}", flush=True)
        train(model, train_loader, criterion, optimizer, device, log=rank == 0)
    # The plain module, not the DDP wrapper: the wrapper's forward can run collectives (a buffer broadcast),
    # which hang once the ranks score different numbers of batches.
    accuracy = evaluate(model.module, testset, rank, world_size, device)
    if rank == 0:
        print(f"test accuracy: {accuracy:.4f}")
        if args.save:  # to compare this run with another (the replicas are identical: rank 0's will do)
            torch.save(model.module.state_dict(), args.save)
    dist.destroy_process_group()  # leave the group cleanly: no hang or warning at exit
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
    if not download(args.data_root):  # checked before any rank starts: one clear line
        sys.exit(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # a port the OS says is free, not a fixed 23456 that may be taken
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # loopback: the ranks are all here
    try:
        mp.spawn(spawned, args=(args.world_size, args), nprocs=args.world_size)
    except mp.ProcessExitedException as e:  # a rank exited with an error code and has said why
        sys.exit(e.exit_code)
