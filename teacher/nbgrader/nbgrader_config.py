"""nbgrader's settings for the exercise assignment (teacher/grading.py copies this into a course folder)."""
c = get_config()  # noqa: F821 - nbgrader's config loader defines it

c.CourseDirectory.course_id = "ddp-tutorial"
# The blank every solution region becomes: the checks read NotImplementedError as "not done yet".
c.ClearSolutions.code_stub = {"python": "# Your code here\nraise NotImplementedError()"}
# A graded cell runs a check on real processes twice (visible and hidden test); the first waits for the
# forkserver to import torch. nbgrader's default of 30 s per cell is too short on a busy machine.
c.Execute.timeout = 300
