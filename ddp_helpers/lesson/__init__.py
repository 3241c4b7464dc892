"""What only the notebooks use: plots, the by-hand reference, lesson mechanics, timelines, the control panel.

The notebooks reach the package through `ddp_helpers`, `ddp_helpers.data`, `ddp_helpers.exercises` and this
namespace (`from ddp_helpers import lesson`, then `lesson.CommRecorder`), with the figures in `lesson.figures`;
`tests/project/test_notebook_imports.py` holds them to that. What a lesson reads or runs of the engine and the
launcher is re-exported here, under a name that says what it shows, so a module moved inside the package changes
this table, not a notebook. Names are imported on first use: a rank that unpickles a cell's function loads only
the modules it calls.
"""
from __future__ import annotations

from ..common.lazy import lazy_exports

_EXPORTS = {
    # the lessons' own tools, by subject
    "CommRecorder": "lesson.comms", "collective_mismatch": "lesson.comms", "ring_all_reduce": "lesson.comms",
    "ring_bytes_per_rank": "lesson.comms", "dump_flight_recorder": "lesson.comms",
    "read_flight_recorder": "lesson.comms", "flight_recorder_unsupported": "lesson.comms",
    "GraphCounter": "lesson.compiling", "build_deep_mlp": "lesson.compiling", "cxx_compiler": "lesson.compiling",
    "agent_events": "lesson.debugging", "first_divergence": "lesson.debugging", "thread_stacks": "lesson.debugging",
    "agreement": "lesson.handbuilt", "build_net": "lesson.handbuilt", "names_of": "lesson.handbuilt",
    "record_sends": "lesson.handbuilt", "tensor_bytes": "lesson.handbuilt",
    "run_script": "lesson.live_script",
    "saved_as_if_on": "lesson.loading", "saved_locations": "lesson.loading",
    "build_batchnorm_model": "lesson.mechanics", "build_branch_model": "lesson.mechanics",
    "comm_failure": "lesson.mechanics", "tidy_error": "lesson.mechanics",
    "RecordingStore": "lesson.rendezvous", "address_owner": "lesson.rendezvous",
    "PARTS": "lesson.sharding", "rank_bytes": "lesson.sharding", "plot_rank_bytes": "lesson.sharding",
    # what the lessons read or run of the engine, the launcher and the files shipped beside the notebooks
    "device_for": "engine.worker", "forward_backward": "engine.worker", "GpuLayout": "ranks.env",
    "recording_hook": "engine.hooks:recording", "GradRecorder": "engine.hooks",
    "rng_state": "engine.rng", "set_rng_state": "engine.rng",
    "usable_cores": "ranks.cores", "cpu_quota": "ranks.cores", "cpu_budget": "ranks.cores",
    "binding_plan": "ranks.cores", "resolve_start_method": "ranks.startmethod",
    "example_file": "common.shipped",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), base="ddp_helpers")
