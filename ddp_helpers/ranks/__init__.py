"""Starting ranks and ending them: launch(), the rank entry every rank runs, and the process hygiene around them."""
