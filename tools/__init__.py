"""Development tools of the project (not shipped in the runtime package): the container rehearsal
and the speech evaluation."""
