"""The agents of a job that restarts, spans machines or is elastic: node 0's coordinator, the
control plane, hosts, ssh.

What is where:

- `admission`: What node 0 says to the other agents of a multi-node job, fixed (`coordinator`)
  or elastic (`elastic_nodes`): whether one is let in (`refusal`,...
- `control`: The control plane between the agents of a multi-node job: authenticated messages,
  heartbeats.
- `coordinator`: Node 0's agent, the coordinator: runs a job in attempts, restarts it when a
  rank fails.
- `elastic`: `tandem run --min-np A --max-np B`: a job that goes on when ranks fail and grows
  when it can.
- `elastic_hosts`: `tandem run --min-np A --max-np B -H h0:4,h1:4` (or `--hostfile`): an elastic
  job whose agents this machine starts, over ssh, and whose discovery...
- `elastic_nodes`: An elastic job across machines: one agent per machine, node 0 forms the
  rounds.
- `elastic_options`: What `tandem run` refuses about an elastic job's options
  (--min-np/--max-np, the discovery script), before anything starts: the reason in words,...
- `hosts`: Host lists as `horovodrun` spells them: `-H node1:4,node2:4` and `--hostfile`.
- `multinode`: Multi-node jobs: one agent per machine, joined by an authenticated control plane.
- `ssh`: `tandem run -H node1:4,node2:4`: where the ranks go, and the commands that start remote
  agents.
"""
