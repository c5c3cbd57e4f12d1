"""What a person reads about a study, computed from storage alone: who runs it, times and costs, charts, progress.

| module | owns |
|---|---|
| `outcome` | what a study produced: baselines, each trial's best checkpoint, collapse and degradation, the adapter to take |
| `status` | whether a process runs a study now (its presence heartbeats), and each study of a storage at a glance |
| `timeline` | when each trial trained, what trains now, ETAs, compute spent |
| `charts` | charts comparing a study's trials (the dashboard's figures, parallel coordinates) |
| `trial_svg` | one trial's per-chunk charts as SVG (its ``rfopt-metrics.svg`` artifact) |
| `display` | the terminal's progress bar and leaderboard text |
"""
