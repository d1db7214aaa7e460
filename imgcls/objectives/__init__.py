"""Training objectives: what a batch's loss is. One module per objective (`base.py`: the task's loss;
`distillation.py`, its teacher in `teacher.py`: the task's loss and a frozen teacher's term; `incremental.py`: a
class-incremental run's, distilled from its base), registered in `registry.py`. This package's
own import stays light: the settings modules beside it are read by the torch-free config."""
