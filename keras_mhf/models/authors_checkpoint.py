def is_authors_checkpoint(preset):
    return False
