"""From predicted masks to cleaned masks and instances (floor 3).

``masks`` cleans the masks of one volume held in memory (small objects, holes) and labels its
instances (connected components or a distance-transform watershed); ``neurons`` cuts neurons
apart by their predicted membranes; ``blockwise`` runs the same steps on a stored region block
by block, and ``blockwise_labels`` labels a mask too large for memory across blocks and ranks.
"""
