"""Where files live: paths as users type them (local, `~`, gs://), local mirrors of remote
folders, and a full disk reported in one line."""
