"""Training: the train state, the pure train/eval steps, optimizers and schedules, the loop
(loop.py, behind `jaxmoe train`, calling trainer.py's Trainer), metrics, goodput, profiling,
the curriculum's hooks and the workdir lock."""
