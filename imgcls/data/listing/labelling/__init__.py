"""How samples carry their labels: a class, or tags (label formats), and the tag-aware split."""
