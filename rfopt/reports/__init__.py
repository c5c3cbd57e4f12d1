"""What a person reads about a study, computed from storage alone: who runs it, times and costs, charts, progress.

| module | owns |
|---|---|
| `results` | the result types a user receives, in one home: `LeaderboardRow`, `StudyOutcome`, `TrialOutcome`, `Recommendation` (and its `Rival`), `MissingBest` |
| `outcome` | what a study produced (a `StudyOutcome`): baselines, each trial's best checkpoint, collapse and degradation, the adapter to take |
| `replicates` | a config's runs across seeds (its original and replicates): their mean and between-seed standard error, which config wins across seeds |
| `status` | whether a process runs a study now (its presence heartbeats), and each study of a storage at a glance |
| `timeline` | when each trial trained, what trains now, ETAs, compute spent |
| `leaderboard` | the study's leaderboard, built in one place: each trial a `LeaderboardRow`, best first; a clone's params held under another name |
| `lead` | which trial leads and whether its lead is more than noise; param importances |
| `charts` | charts comparing a study's trials (the dashboard's Plotly figures); each trial's colour and series name |
| `parallel` | the parallel coordinates (params to value) as an SVG |
| `trial_svg` | one trial's per-chunk charts as SVG (its ``rfopt-metrics.svg`` artifact) |
| `display` | the terminal's progress bar and leaderboard text |
"""
