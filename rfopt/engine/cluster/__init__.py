"""A study on a Ray cluster: one worker per device, the caller's view from storage.

| module | owns |
|---|---|
| `ray_cluster` | `RayCluster` (offered as `rfopt.RayCluster`): the caller's side, the cluster's size checked, actors started and watched |
| `ray_worker` | one worker on a Ray actor: the job every actor is given, the actor, its storage reachability check |
"""
