"""Training objectives: what a batch's loss is (the task's loss, distillation from a teacher)."""
