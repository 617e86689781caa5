"""An agent: one OS process per agent. Today an idle process shell
(`process.serve`): it reports to the supervisor, joins the broker and answers
pings; the agent loop (model, ops, gate) fills it in a later issue."""
