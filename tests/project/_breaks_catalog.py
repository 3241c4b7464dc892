"""Notebook 13's entries: each message, where torch (or Python) writes it, and where users met it.

One row per entry, in the notebook's order. `heading` is the entry's markdown heading (its anchor is myst's slug of
it); `shown` is the text its stored outputs must contain (torch's or Python's own words, with only what varies by
run replaced); `needles` are fixed parts of the message and the file that holds them: a path under the installed
torch package, or `stdlib:` and a path under Python's library. `gpu` marks the entries whose message only a GPU
job prints: their `gpu_text` is quoted from torch in the prose; their stored output shows what runs here (entry
7's gloo timeout is itself provoked; entries 25 and 27 can't be provoked on a CPU: `provoked=False`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Tuple

NOTEBOOK = "13_when_it_breaks"
STAGES = ["Start-up and rendezvous", "The process group", "Wrapping the model", "Backward",
          "Checkpoints", "Notebooks and start methods", "Shutdown"]


@dataclass(frozen=True)
class Entry:
    stage: str
    heading: str
    shown: str
    needles: Tuple[Tuple[str, str], ...]
    cited: str
    gpu_text: str = ""
    also_shown: Tuple[str, ...] = field(default_factory=tuple)
    provoked: bool = True  # False: no CPU run can raise it; the output shows torch's text read from its source

    @property
    def anchor(self) -> str:
        """The heading's anchor as myst-parser makes it (GitHub's slug): what the index links to."""
        return slug(self.heading)


def slug(heading: str) -> str:
    """myst-parser's default heading slug (mdit_py_plugins.anchors): lower case, spaces to '-', other marks gone."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace(" ", "-"))


CPU_SO = "lib/libtorch_cpu.so"
CUDA_SO = "lib/libtorch_cuda.so"
C10D = "distributed/distributed_c10d.py"
DDP_PY = "nn/parallel/distributed.py"

ENTRIES: List[Entry] = [
    Entry(STAGES[0], "1. environment variable RANK expected, but not set",
          "environment variable RANK expected, but not set",
          (("distributed/rendezvous.py", "expected, but not set"),
           ("distributed/rendezvous.py", "Error initializing torch.distributed using")),
          "https://github.com/bubbliiiing/yolov4-pytorch/issues/313"),
    Entry(STAGES[0], "2. The server socket has failed to listen: address already in use",
          "The server socket has failed to listen on any local network address.",
          ((CPU_SO, "The server socket has failed to listen on any local network address. port: {}"),),
          "https://github.com/showlab/Tune-A-Video/issues/90", also_shown=("address already in use",)),
    Entry(STAGES[0], "3. Timed out waiting for clients: 2/3 clients joined",
          "seconds waiting for clients. 2/3 clients joined.",
          ((CPU_SO, "Timed out after {} seconds waiting for clients. {}/{} clients joined."),),
          "https://github.com/pytorch/pytorch/pull/111805"),
    Entry(STAGES[1], "4. Default process group has not been initialized",
          "Default process group has not been initialized, please make sure to call init_process_group.",
          ((C10D, "Default process group has not been initialized, "),
           (C10D, "please make sure to call init_process_group.")),
          "https://github.com/megvii-model/YOLOF/issues/11"),
    Entry(STAGES[1], "5. trying to initialize the default process group twice",
          "trying to initialize the default process group twice!",
          ((C10D, "trying to initialize the default process group twice!"),),
          "https://github.com/NVIDIA/Megatron-LM/pull/521"),
    Entry(STAGES[1], "6. No backend type associated with device type cpu",
          "No backend type associated with device type cpu",
          ((CPU_SO, "No backend type associated with device type "),),
          "https://github.com/THUDM/SwissArmyTransformer/issues/173"),
    Entry(STAGES[1], "7. Timed out waiting for recv operation (the NCCL watchdog timeout)",
          "Timed out waiting 2000ms for recv operation to complete",
          ((CPU_SO, "ms for recv operation to complete"),
           (CUDA_SO, "Watchdog caught collective operation timeout: ")),
          "https://github.com/hiyouga/LlamaFactory/issues/7396",
          gpu_text="Watchdog caught collective operation timeout"),
    Entry(STAGES[1], "8. Detected mismatch between collectives on ranks",
          "Detected mismatch between collectives on ranks. Rank 0 is running collective: ",
          ((CPU_SO, "Detected mismatch between collectives on ranks. Rank "),
           (CPU_SO, "Collectives differ in the following aspects: ")),
          "https://github.com/Lightning-AI/pytorch-lightning/issues/19106",
          also_shown=("Collectives differ in the following aspects:",)),
    Entry(STAGES[2], "9. DistributedDataParallel object has no attribute",
          "'DistributedDataParallel' object has no attribute 'fc'",
          (("nn/modules/module.py", "object has no attribute"),),
          "https://github.com/ultralytics/yolov5/issues/90"),
    Entry(STAGES[2], "10. DistributedDataParallel is not needed when a module has no parameter that requires a gradient",
          "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient.",
          ((DDP_PY, "DistributedDataParallel is not needed when a module "),
           (DDP_PY, "doesn't have any parameter that requires a gradient.")),
          "https://github.com/huggingface/accelerate/issues/760"),
    Entry(STAGES[2], "11. device_ids and output_device arguments only work with single-device GPU modules",
          "DistributedDataParallel device_ids and output_device arguments only work with single-device/multiple-device "
          "GPU modules or CPU modules, but got device_ids [0], output_device None, and module parameters "
          "{device(type='cpu')}.",
          ((DDP_PY, "DistributedDataParallel device_ids and output_device arguments "),
           (DDP_PY, "only work with single-device/multiple-device GPU modules or CPU modules, ")),
          "https://github.com/pytorch/pytorch/issues/100243"),
    Entry(STAGES[2], "12. DDP expects same model across all ranks",
          "DDP expects same model across all ranks, but Rank 0 has 2 params, while rank 1 has inconsistent 4 params.",
          ((CPU_SO, "DDP expects same model across all ranks, but Rank "),),
          "https://github.com/Kent0n-Li/ChatDoctor/issues/49"),
    Entry(STAGES[2], "13. SyncBatchNorm layers only work with GPU modules",
          "SyncBatchNorm layers only work with GPU modules",
          ((DDP_PY, "SyncBatchNorm layers only work with GPU modules"),),
          "https://github.com/QData/spacetimeformer/issues/90"),
    Entry(STAGES[3], "14. Expected to have finished reduction in the prior iteration",
          "Expected to have finished reduction in the prior iteration before starting a new one.",
          ((CPU_SO, "Expected to have finished reduction in the prior iteration before starting a new one."),),
          "https://github.com/Megvii-BaseDetection/YOLOX/issues/885"),
    Entry(STAGES[3], "15. find_unused_parameters=True was specified but did not find any unused parameters",
          "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters in "
          "the forward pass.",
          ((CPU_SO, "find_unused_parameters=True was specified in DDP constructor, but did not find any unused "
                    "parameters in the forward pass."),),
          "https://github.com/ZhangGongjie/Meta-DETR/issues/60"),
    Entry(STAGES[3], "16. Expected to mark a variable ready only once",
          "Expected to mark a variable ready only once.",
          ((CPU_SO, "Expected to mark a variable ready only once. "),),
          "https://github.com/microsoft/FocalNet/issues/4"),
    Entry(STAGES[3], "17. Your training graph has changed in this iteration",
          "Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, but "
          "then got used in the second iteration. this is not compatible with static_graph set to True.",
          ((CPU_SO, "Your training graph has changed in this iteration, "),
           (CPU_SO, "compatible with static_graph set to True.")),
          "https://github.com/msed-Ebrahimi/ARoFace/issues/5"),
    Entry(STAGES[4], "18. Missing keys and Unexpected keys in state_dict: module.",
          'Unexpected key(s) in state_dict: "module.fc.weight", "module.fc.bias".',
          (("nn/modules/module.py", "Unexpected key(s) in state_dict: "),
           ("nn/modules/module.py", "Missing key(s) in state_dict: ")),
          "https://github.com/aks2203/deep-thinking/issues/5",
          also_shown=('Missing key(s) in state_dict: "fc.weight", "fc.bias".',)),
    Entry(STAGES[4], "19. Weights only load failed",
          "Weights only load failed.",
          (("serialization.py", "Weights only load failed."),
           ("_weights_only_unpickler.py", "was not an allowed global by default.")),
          "https://github.com/ROCm/Megatron-LM/pull/56",
          also_shown=("Unsupported global: GLOBAL argparse.Namespace was not an allowed global by default.",)),
    Entry(STAGES[4], "20. Attempting to deserialize object on a CUDA device",
          "Attempting to deserialize object on a CUDA device but torch.cuda.is_available() is False.",
          (("serialization.py", "Attempting to deserialize object on a "),
           ("serialization.py", "please use torch.load with map_location=torch.device('cpu') ")),
          "https://github.com/hkchengrex/Cutie/issues/37"),
    Entry(STAGES[4], "21. No such file or directory: the checkpoint rank 0 has not written yet",
          "FileNotFoundError: [Errno 2] No such file or directory: '<checkpoint>'",
          (("strerror:ENOENT", "No such file or directory"),),
          "https://discuss.pytorch.org/t/why-the-second-barrier-is-used-in-the-ddp-tutorial/87849"),
    Entry(STAGES[5], "22. Can't get attribute on module main (mp.spawn from a notebook)",
          "Can't get attribute 'worker' on <module '__main__' (built-in)>",
          (("stdlib:pickle.py", "Can't get attribute {!r} on {!r}"),),
          "https://github.com/jupyter/notebook/issues/6258"),
    Entry(STAGES[5], "23. process 1 terminated with exit code 1",
          "process 1 terminated with exit code 1",
          (("multiprocessing/spawn.py", "terminated with exit code"),),
          "https://github.com/facebookresearch/moco/issues/54"),
    Entry(STAGES[5], "24. An attempt has been made to start a new process before the bootstrapping phase",
          "An attempt has been made to start a new process before the current process has finished its "
          "bootstrapping phase.",
          (("stdlib:multiprocessing/spawn.py", "An attempt has been made to start a new process before the"),
           ("stdlib:multiprocessing/spawn.py", "current process has finished its bootstrapping phase.")),
          "https://github.com/Lightning-AI/pytorch-lightning/issues/16900"),
    Entry(STAGES[5], "25. Cannot re-initialize CUDA in forked subprocess",
          "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use the "
          "'spawn' start method",
          (("cuda/__init__.py", "Cannot re-initialize CUDA in forked subprocess. To use CUDA with "),
           ("cuda/__init__.py", "multiprocessing, you must use the 'spawn' start method")),
          "https://github.com/facebookresearch/PointContrast/issues/15",
          gpu_text="Cannot re-initialize CUDA in forked subprocess", provoked=False),
    Entry(STAGES[6], "26. Connection closed by peer",
          "Connection closed by peer [127.0.0.1]:PORT. This is typically caused by a remote worker crashing.",
          ((CPU_SO, "Connection closed by peer "),
           (CPU_SO, "This is typically caused by a remote worker crashing.")),
          "https://github.com/RVC-Project/Retrieval-based-Voice-Conversion-WebUI/issues/1882"),
    Entry(STAGES[6], "27. destroy_process_group() was not called before program exit",
          "NCCL's warning in gloo's output at exit: False",
          ((CUDA_SO, "destroy_process_group() was not called before program exit, which can leak resources."),),
          "https://github.com/ai2cm/ace/issues/679",
          gpu_text="destroy_process_group() was not called before program exit, which can leak resources.",
          provoked=False),
]
