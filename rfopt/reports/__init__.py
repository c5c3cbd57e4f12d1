"""What a person reads about a study, computed from storage alone: times and costs, charts, progress and leaderboard.

| module | owns |
|---|---|
| `timeline` | when each trial trained, ETAs, compute spent |
| `charts` | charts comparing trials (the dashboard's) and one trial's per-chunk charts as SVG (its artifact) |
| `display` | the terminal's progress bar and leaderboard text |
"""
