"""The CellMap layout read in world coordinates: ``cellmap`` (datasets, EM levels, label crops,
reading boxes on any grid, EM intensity ranges), ``split_lists`` (CSV / TOML lists of volumes
and crops), ``crops`` (what a run reads: discovery, its checks, the train/validation split)
and ``volume_source`` (the one type a task takes its data from)."""
