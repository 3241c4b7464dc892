"""Teacher material for the exercise notebook: the solutions and the typical wrong answers (keep away from learners)."""
