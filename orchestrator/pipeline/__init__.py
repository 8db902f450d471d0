"""The article pipeline: research -> writing -> illustration -> assembly, as stored, resumable steps."""
