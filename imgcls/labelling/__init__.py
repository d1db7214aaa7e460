"""What to label next: the selection strategies (`strategies.py`), the scored pool and the picks file
(`picking.py`), and Label Studio's tasks and annotations (`label_studio.py`)."""
