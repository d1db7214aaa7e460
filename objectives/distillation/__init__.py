"""Knowledge distillation: a frozen teacher whose outputs add a term to the student's loss (`Distiller`), the
teacher's loading and identity (`teacher`), its input conversion (`conversion`) and the loss terms (`losses`).
The training step calls `Distiller.loss` in one place; the trainer builds it, validates the teacher once,
measures the agreement at validation and records the teacher's identity in last.pt."""
