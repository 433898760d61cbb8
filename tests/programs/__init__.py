"""Training programs as tests (issue 33): a tiny model trained with the README's Checkpointer loop under plain,
DDP and FSDP2 parallelism, SIGKILLed at a seeded step, restarted, finished, and compared bitwise with a run
that was never interrupted. ``train`` is the program, ``launcher`` the process that forks its ranks, and
``test_programs`` the matrix (parallelism x format x mode x storage)."""
