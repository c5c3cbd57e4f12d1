"""What a person reads about a study, computed from storage alone: who runs it, times and costs, charts, progress.

| module | owns |
|---|---|
| `outcome` | what a study produced: baselines, each trial's best checkpoint, collapse and degradation, the adapter to take |
| `replicates` | a config's runs across seeds (its original and replicates): their mean and between-seed standard error, which config wins across seeds |
| `status` | whether a process runs a study now (its presence heartbeats), and each study of a storage at a glance |
| `timeline` | when each trial trained, what trains now, ETAs, compute spent |
| `lead` | which trial leads and whether its lead is more than noise; param importances |
| `charts` | charts comparing a study's trials (the dashboard's Plotly figures); each trial's colour and series name |
| `parallel` | the parallel coordinates (params to value) as an SVG |
| `trial_svg` | one trial's per-chunk charts as SVG (its ``rfopt-metrics.svg`` artifact) |
| `display` | the terminal's progress bar and leaderboard text |
"""
