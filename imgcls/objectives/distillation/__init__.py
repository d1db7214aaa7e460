"""Knowledge distillation, the `distill` objective: a frozen teacher whose outputs add a term to the student's
loss (`distiller.Distiller`), the teacher's loading and identity (`teacher`), its input conversion
(`conversion`), the loss terms (`losses`) and its validation and agreement with the student (`agreement`)."""
