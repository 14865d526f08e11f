"""The cutting room: a planned model cut into segment files, with a manifest, then verified.

:mod:`~partitioner.cutting.split` runs a split end to end over :mod:`partitioner.planning` and
:mod:`partitioner.analysis`; segments, the segment cache, segment files, the manifest,
calibration and verification are its parts. The module list is the map in :mod:`partitioner`.
"""
