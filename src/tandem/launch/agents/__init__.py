"""The one agent of every job that restarts, spans machines or is elastic: a fixed job is an
elastic job whose size cannot change (min = max), restarted whole while restarts are left.

What is where:

- `admission`: What node 0 says to the other agents of a multi-node job: whether one is let
  in (`refusal`,...
- `control`: The control plane between the agents of a multi-node job: authenticated messages,
  heartbeats.
- `coordinator`: Node 0's agent of every such job: the store, the control plane, the attempts
  (a fixed job restarts them whole; an elastic one runs its attempt in rounds).
- `elastic`: `tandem run --min-np A --max-np B`: the rounds of an elastic job, which goes on
  when ranks fail and grows when it can.
- `elastic_options`: What `tandem run` refuses about an elastic job's options
  (--min-np/--max-np, the discovery script), before anything starts: the reason in words,...
- `hosts`: Host lists as `horovodrun` spells them: `-H node1:4,node2:4` and `--hostfile`.
- `member`: The agent of node 1, 2... of every multi-node job, fixed or elastic: one loop for
  both.
- `multinode`: `launch`, the way in for every job the agent runs: --nnodes, -H/--hostfile,
  restarts, elastic ranges.
- `nodes`: Node 0's table of the job's machines: letting the other agents in, who runs where,
  ending the job on all of them.
- `ssh`: `tandem run -H node1:4,node2:4`: where the ranks go, and the commands that start remote
  agents.
"""
