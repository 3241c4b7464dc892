"""nbgrader's settings for the exercise assignment (teacher/grading.py copies this into a course folder)."""
c = get_config()  # noqa: F821 - nbgrader's config loader defines it

c.CourseDirectory.course_id = "ddp-tutorial"
# The blank every solution region becomes: the checks read NotImplementedError as "not done yet".
c.ClearSolutions.code_stub = {"python": "# Your code here\nraise NotImplementedError()"}
# A graded cell runs a check on real processes twice (visible and hidden test); the first waits for the
# forkserver to import torch. nbgrader's default of 30 s per cell is too short on a busy machine.
c.Execute.timeout = 300
# Each kernel ends at once when its notebook is graded (its outputs are saved by then). A graceful shutdown waits
# ~2.5 s per submission: ipykernel waits for every process in its group to end, and multiprocessing's resource
# tracker (started with the forkserver) ignores SIGTERM (resource_tracker.main), so jupyter_client ends the kernel
# after half its shutdown_wait_time of 5 s. Measured: autograding four samples took 36 s graceful, 25 s so.
c.Execute.shutdown_kernel = "immediate"
