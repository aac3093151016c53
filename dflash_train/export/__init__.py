"""dflash-export's parts: the model card (and its template) and the export writer."""
