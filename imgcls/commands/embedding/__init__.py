"""embed.py's and search.py's work: vectors and their index, nearest neighbours."""
