# Listing 7.2 as the book prints it (callout numbers left out, a few lines joined), kept to compare with
# ddp_mnist.py, the fixed version. As printed it needs two GPUs and never starts: nothing calls mp.spawn.
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


class Flatten(nn.Module):
    def forward(self, input):
        return input.view(input.size(0), -1)


def train(model, trainloader, criterion, optimizer, device):
    model.train()
    for batch_idx, (data, target) in enumerate(trainloader):
        print(f'Process {device}, Batch {batch_idx}')
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()


def main(rank, world_size):
    filepath = '~/.pytorch/MNIST_data/'
    dist.init_process_group(
        backend='nccl',
        init_method='tcp://localhost:23456',
        rank=rank,
        world_size=world_size
    )
    torch.manual_seed(0)
    device = torch.device(f'cuda:{rank}')
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    trainset = datasets.MNIST(filepath, download=True, train=True, transform=transform)
    train_loader = DataLoader(trainset, batch_size=64, shuffle=True, num_workers=2)
    model = nn.Sequential(Flatten(), nn.Linear(784, 10)).to(device)
    model = DistributedDataParallel(model, device_ids=[rank])
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, train_loader, criterion, optimizer, device)
