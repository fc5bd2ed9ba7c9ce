"""`layerline plan`: should a model be distributed at all, and how: predicted, then checked.

Owns the planner: a model's memory arithmetic (`shapes`), the devices and links it may run on
(`hardware`), this machine's measured profile (`profile`, made by `calibrate`), the cost model
(`predict`), the choice among layouts and its reason (`recommend`), what to run for it (`emit`) and
the comparison of predictions with local clusters measured in the same run (`check`). The command
line is `layerline.cli.plan`'s.
"""
