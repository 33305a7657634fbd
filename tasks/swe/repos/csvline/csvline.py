def split_csv(line):
    return line.split(",")
