"""What earlier runs teach: the run record, its store and index, and learned sizes and times."""
