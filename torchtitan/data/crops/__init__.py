"""The data's volumes and label crops: ``layout`` (CellMap-layout datasets, EM levels and label
crops, found in a folder or a split list, ``split_lists``), ``selection`` (what a run reads:
the checks, the train/validation split, the label budget) and ``reader`` (the one reader of a
crop's EM and labels on the training grid, and EM as the model's input)."""
